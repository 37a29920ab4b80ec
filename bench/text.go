package main

import (
	"math/rand/v2"
	"strings"
)

// words is the vocabulary of the generated prompts: common English words, so that the text looks
// like prose to a real tokenizer (about 4 bytes per token, like the simulator assumes).
var words = strings.Fields(`the of and to in is that for it as was with be by on not he this are or his
from at which but have an they you were her she there been one all we their has would when if so no
what can out other into more some could time these two may then do first any my now such like our
over man me even most made after also did many before must through back years where much your way well
down should because each just those people how too little state good very make world still own see men
work long get here between both life being under never day same another know while last might us great
old year off come since against go came right used take three states himself few house use during
without again place around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact though water less public
put think almost hand enough far took head yet government system better set told nothing night end why
called find going look asked later knew point next program city business give group toward young days
let room president side social given present several order national possible rather second face per
among form important often things looked early white case john become large big need four within felt
along children saw best church ever least power development light thing seemed family interest want
members mind country area others done turned although open god service problem certain kind different
thus began door help means sense whole matter perhaps itself york times law human line above name
example action company hands local show five history gave today either act feet across taken past quite
anything seen having death week experience body word half really field am car words already themselves
information tell college shall money period held keep sure probably free seems political real behind
cost model token cache request answer explain write summary table list code review document question`)

// textOfTokens returns seeded English-like text of about n tokens (4 bytes per token, the
// simulator's and llm-d's tokenizer-free estimate).
func textOfTokens(rng *rand.Rand, n int) string {
	if n <= 0 {
		return ""
	}
	want := 4 * n
	var b strings.Builder
	b.Grow(want + 16)
	sentence := 0
	for b.Len() < want {
		w := words[rng.IntN(len(words))]
		if sentence == 0 && len(w) > 0 {
			w = strings.ToUpper(w[:1]) + w[1:]
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w)
		sentence++
		if sentence > 6 && rng.IntN(10) == 0 {
			b.WriteByte('.')
			sentence = 0
		}
	}
	return b.String()
}
